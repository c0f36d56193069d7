"""Worked examples of fitting a project of your own, each a module of plain torch code plus a
file in conf/experiment/ (`experiment=<name>`), none editing the template; the list, with what
each shows: docs/make_it_yours.md ("Worked examples").
"""
