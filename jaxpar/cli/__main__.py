from jaxpar.cli import console

console()
