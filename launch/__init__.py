"""The launch layer: the `hetpipe` command line, local runs (every process on this machine), and
the files that bring a cluster up elsewhere (compose). It sits above the services and the core."""
