"""MCP tools run by the server: the owner configures servers (settings.py), the hub connects to
them and runs their tools (hub.py, connection.py); the web layer lists and calls them through
the hub alone. Nothing here is imported until a server is configured, but settings.py."""
