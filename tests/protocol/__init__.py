"""Tests of engines.protocol: request/response models and error replies."""
