"""The error every loader raises for weights it cannot use."""


class WeightsError(ValueError):
    """Weight files missing, corrupt or not matching the config."""
