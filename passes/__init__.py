"""fxdebug's built-in passes, written only against fxdebug's public pass-authoring API."""

__all__: list[str] = []
