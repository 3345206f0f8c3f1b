"""Models as ``torch.nn.Module`` that the project trains in its tests and benchmarks (:mod:`bagua_torch.models.gpt`)."""
