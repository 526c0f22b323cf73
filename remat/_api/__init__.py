"""The entry points a user calls: ``remat`` (the transform), ``remat_module`` and ``unremat_module``, and
``checkpoint`` (torch's call form, its policies translated, and the scoped routing of torch's checkpoint).
"""
