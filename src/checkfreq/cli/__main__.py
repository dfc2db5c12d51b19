from checkfreq.cli import app

app()
