"""Translation models: English → Spanish Bible verses (`bible_en_es`)."""
