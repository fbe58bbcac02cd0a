"""Machine translation tasks: English–Spanish Bible verses.

`sword` reads the SWORD zText modules Debian ships, `versification` maps their
index slots to verses, `bible_en_es` aligns the two Bibles into a TFDS
dataset and `vocab` trains and applies the joint SentencePiece vocabulary.
"""
