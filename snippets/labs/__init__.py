"""The workshop's labs: the scripts a lab page has the learner run, change and compare."""
