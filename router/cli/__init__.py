"""The ``kvroute`` command line: the dispatcher and one module per subcommand."""
