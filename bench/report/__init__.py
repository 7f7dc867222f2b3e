"""Rendering results: SVG plots (svg.py) and re-rendering them from kept JSON (render.py)."""
