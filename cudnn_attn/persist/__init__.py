"""Plans that survive the process: the on-disk store and building through it."""
