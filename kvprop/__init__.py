"""kvprop: stateful property-based testing for paged, prefix-caching KV-cache allocators."""

__version__ = "0.1.0"
