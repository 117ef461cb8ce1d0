"""A toy classifier whose labels come from an annotation file: the example for gpucase capture."""
