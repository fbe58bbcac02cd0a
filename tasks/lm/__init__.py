"""Language modelling: a decoder-only Transformer on the Bible's English side.

`input_generator` cuts the prepared corpus (`bible_en_es`, English verses,
the same held-out books) into blocks of tokens; `layers` and `model` are the
causal Transformer with its embedding and softmax tied.
"""
