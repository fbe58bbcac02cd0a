"""Tasks: models, input generators and datasets of each domain.

`tasks/image/`, `tasks/mt/` and `tasks/lm/` hold a domain each. The data they train on is
real and offline: Debian packages (Fashion-MNIST, two public-domain Bibles)
are extracted into a local cache by `python -m lingvo_pipe.tasks.prepare_data` and turned
into TFDS datasets there, so no code path ever downloads at training time.
`tasks.data_paths` says where everything lives; `tasks.datasets.load` gives a
split as in-memory numpy arrays.
"""
