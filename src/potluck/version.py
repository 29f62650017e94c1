"""potluck's version, in a module of its own so that any layer can name it (in the
``source`` of a calibration it writes, say) without importing the package's API."""

__version__ = "0.1.0"
