"""Tasks from dataset files (docs/DATASETS.md): `env: dataset` in `tasks.mix`."""
