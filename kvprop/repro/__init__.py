"""What a user does with a found trace: replay it with a step log, minimise it, write a
standalone pytest regression test, or, for a find on a vLLM target, a reproducer that needs
only vLLM with its report. It may import every layer below it, up to ``kvprop.search``.
"""
