"""Prefill/decode disaggregation: a prefill server computes a prompt's KV and first token and
writes them into KV slots a decode server pre-allocated; the decode server continues from there.
See `disagg/base.py` for the protocol."""
