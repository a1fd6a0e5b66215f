"""The commands of ``python -m recursive_lightning``, one module each: its arguments parsed into the library's typed
options, the library function called (the same one ``recursive_lightning.api`` exports), what it prints and its
exit status. ``cli.py`` dispatches to ``<module>.main(argv)``; the work itself lives in the library below."""
