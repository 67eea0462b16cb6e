"""Logit controls as plug-ins: one module each, behind ``base.LogitsProcessor``."""
