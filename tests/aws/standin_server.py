"""The HTTP server under the tests' stand-ins for SageMaker's runtime."""

import sys
from http.server import ThreadingHTTPServer


class StandInServer(ThreadingHTTPServer):
    """A client that drops its kept-alive connection (the CLI, done with a broken stream) is no
    error of the runtime's: socketserver would print its traceback to stderr, from the server's
    thread, into whatever CLI output a test is capturing at that moment. Other errors print."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)
