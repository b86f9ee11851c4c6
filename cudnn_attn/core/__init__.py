"""What a call is: types, errors, settings, the configuration, masks, parameters, validation, values, support."""
