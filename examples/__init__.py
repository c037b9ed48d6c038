"""Example targets: allocators written outside kvprop and tested through its target contract (docs/targets.md)."""
