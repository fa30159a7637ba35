"""Model architectures; `registry.get_model_class` maps HF `architectures` to a class."""
