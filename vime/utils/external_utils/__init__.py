"""Helpers for launch scripts written in Python, where slime's scripts import them
(``slime.utils.external_utils`` → ``vime.utils.external_utils``)."""
