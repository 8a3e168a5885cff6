"""Prompts, preference pairs and unpaired rows, and the built-in task."""
