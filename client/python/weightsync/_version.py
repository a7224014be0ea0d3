# Generated from /VERSION, the one version of the daemon and this package;
# //client/python:version_up_to_date_test keeps the two equal.
__version__ = "0.1.0"
