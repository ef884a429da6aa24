"""Record formats and file sources: text (Criteo, Avazu, libFM), MovieLens, Parquet/Arrow."""
