"""Lesson scripts: what a page or an executed lesson runs to teach one thing."""
