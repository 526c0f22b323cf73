"""Inspection: what a call saves (``saved_residuals``, ``memory_report``) and the measurements behind them.
"""
