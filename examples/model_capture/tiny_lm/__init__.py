"""A character-level sequence classifier: the example for capturing a model's failure."""
