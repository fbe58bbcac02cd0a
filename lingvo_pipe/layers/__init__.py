"""The layer library: one layer family per module.

Import the module you need (`from lingvo_pipe.layers import linear`); nothing
is re-exported here, so adding a layer family touches only its own module.
Every layer follows the contract in `lingvo_pipe.core.base_layer`, and
`tests/layers/test_conformance.py` checks each one against it.
"""
