"""Selects the Hypothesis profile explicitly: $KVPROP_PROFILE, else ``dev`` (``--hypothesis-profile`` still wins)."""

from kvprop.search import profiles

profiles.load()
