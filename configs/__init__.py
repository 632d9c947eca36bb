"""Typed configuration: the pydantic schema, the YAML presets shipped beside it, and the loader."""

from .loader import ConfigError, dump_config, load_config, preset_names
from .schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "dump_config", "load_config", "preset_names"]
