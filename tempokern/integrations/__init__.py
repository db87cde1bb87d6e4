"""Adapters that plug tempokern's fused losses into other libraries' training loops (optional dependencies:
each submodule imports its library only when used)."""
