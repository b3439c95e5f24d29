"""The thin `ugro` client: talks to a UGRO server's REST API over HTTP. Standard library only, no Django."""

__all__ = ["ApiError", "Client", "__version__"]

# UGRO's version, the client's and (imported from here) the server's; pyproject.toml says the same (a test)
__version__ = "0.1.0"

from .http import ApiError, Client
