"""The array-library fronts: the CuPy/DLPack call."""
