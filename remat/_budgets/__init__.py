"""Memory budgets and chain schedules: the policy that solves for a memory limit (two- and three-way), the
device model that prices offloads, and ``remat.sequential``'s schedules.
"""
