"""Endings: how a launch ended, in the user's exit code and one line, and a failed
attempt said in one line when it is started again.
"""
