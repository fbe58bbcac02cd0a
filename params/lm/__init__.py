"""Language models: the Bible's English side (`bible_en`)."""
