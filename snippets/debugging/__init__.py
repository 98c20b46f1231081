"""Errors a learner meets in the first labs, reproduced on purpose, with how to read them."""
