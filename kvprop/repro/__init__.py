"""What a user does with a found trace: replay it with a step log, minimise it, write a
standalone pytest regression test. It may import every layer below it, up to ``kvprop.search``.
"""
