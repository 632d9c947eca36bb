"""A tiny asyncrl environment plug-in, used by tests/test_env_plugin.py."""
