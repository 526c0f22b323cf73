"""Policies: what to keep, drop or offload per op (the built-in policies, their combinators, `decide`), and
``checkpoint_name``.
"""
