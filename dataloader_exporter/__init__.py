"""The `dataloader-exporter` command line: one table of commands, each loaded when used."""
