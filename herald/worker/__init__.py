"""Dispatcher, worker embedding cache, PyTorch-facing API and models."""
