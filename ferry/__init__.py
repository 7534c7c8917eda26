"""Ferry: model weights into GPU memory. What operator, agent, publisher and consumers share."""

# The one version: pyproject.toml reads it from here, and `ferry --version` prints it (also from a source tree).
__version__ = "0.1.0"
