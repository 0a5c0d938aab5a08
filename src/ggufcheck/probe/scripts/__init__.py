"""Standalone probe scripts, run by path inside the *target* interpreter.

Nothing in this folder imports ggufcheck: each file uses only the standard library (and
torch, inside a try), so it runs in a user's production virtualenv where ggufcheck is not
installed. The host side (:mod:`ggufcheck.probe.runner`) starts ``python SCRIPT`` with a
JSON request on stdin and reads JSON lines back. File names carry a ``ggufcheck_`` prefix
because this folder becomes ``sys.path[0]`` of the target and must shadow nothing there.
"""
