"""Sampling: per-request parameters (`sampling_params`), their batched tensor form
(`sampling_batch_info`), and the sampler (`sampler`). Import the submodule you need: the
parameters are read by the processes that never run a model (the HTTP server, the
detokenizer), which should not import torch for them."""
