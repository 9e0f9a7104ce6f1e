package client

import (
	"bufio"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestReadResponse(t *testing.T) {
	big := strings.Repeat("x", 5000)
	for _, tc := range []struct {
		name      string
		in        string
		status    int
		line      string
		body      string
		keepAlive bool
		wantErr   string // substring; "" for success
		malformed bool   // the error is errMalformed
		cutShort  bool   // the error is io.ErrUnexpectedEOF
	}{
		{name: "content-length", in: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", status: 200, line: "200 OK", body: "{}", keepAlive: true},
		{name: "header names any case, LF only", in: "HTTP/1.1 200 OK\ncontent-length:  3 \n\nabc", status: 200, line: "200 OK", body: "abc", keepAlive: true},
		{name: "chunked", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nA;ext=1\r\n0123456789\r\n0\r\n\r\n", status: 200, line: "200 OK", body: "abc0123456789", keepAlive: true},
		{name: "chunked with trailer", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\nX-T: 1\r\n\r\n", status: 200, line: "200 OK", body: "a", keepAlive: true},
		{name: "chunked large", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1388\r\n" + big + "\r\n0\r\n\r\n", status: 200, line: "200 OK", body: big, keepAlive: true},
		{name: "error status", in: "HTTP/1.1 404 Not Found\r\nContent-Length: 19\r\n\r\n404 page not found\n", status: 404, line: "404 Not Found", body: "404 page not found\n", keepAlive: true},
		{name: "no reason phrase", in: "HTTP/1.1 500\r\nContent-Length: 0\r\n\r\n", status: 500, line: "500", keepAlive: true},
		{name: "no content", in: "HTTP/1.1 204 No Content\r\n\r\n", status: 204, line: "204 No Content", keepAlive: true},
		{name: "interim answer skipped", in: "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nz", status: 200, line: "200 OK", body: "z", keepAlive: true},
		{name: "connection close", in: "HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 1\r\n\r\nz", status: 200, line: "200 OK", body: "z"},
		{name: "body to EOF", in: "HTTP/1.1 200 OK\r\n\r\nuntil the end", status: 200, line: "200 OK", body: "until the end"},
		{name: "HTTP/1.0", in: "HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nz", status: 200, line: "200 OK", body: "z"},
		{name: "same length twice", in: "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nz", status: 200, line: "200 OK", body: "z", keepAlive: true},

		{name: "nothing", in: "", wantErr: "status line: EOF"},
		{name: "not HTTP", in: "SSH-2.0-OpenSSH\r\n", wantErr: "status line", malformed: true},
		{name: "HTTP/2", in: "HTTP/2 200 OK\r\n\r\n", wantErr: "status line", malformed: true},
		{name: "status not a number", in: "HTTP/1.1 2x0 OK\r\n\r\n", wantErr: "status code", malformed: true},
		{name: "status too long", in: "HTTP/1.1 2000 OK\r\n\r\n", wantErr: "status code", malformed: true},
		{name: "status out of range", in: "HTTP/1.1 600 Odd\r\n\r\n", wantErr: "status code", malformed: true},
		{name: "status line cut", in: "HTTP/1.1 200 O", wantErr: "status line", cutShort: true},
		{name: "header without colon", in: "HTTP/1.1 200 OK\r\nbroken\r\n\r\n", wantErr: "header line", malformed: true},
		{name: "folded header", in: "HTTP/1.1 200 OK\r\nA: b\r\n c\r\n\r\n", wantErr: "header line", malformed: true},
		{name: "header cut", in: "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", wantErr: "header", malformed: false},
		{name: "negative length", in: "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", wantErr: "Content-Length", malformed: true},
		{name: "length not a number", in: "HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n", wantErr: "Content-Length", malformed: true},
		{name: "length overflows", in: "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n", wantErr: "Content-Length", malformed: true},
		{name: "lengths differ", in: "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nzz", wantErr: "Content-Length", malformed: true},
		{name: "length over the limit", in: "HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n", wantErr: "over the limit", malformed: true},
		{name: "body cut", in: "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", wantErr: "read body of 10 bytes", cutShort: true},
		{name: "body missing", in: "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", wantErr: "read body of 10 bytes", cutShort: true},
		{name: "other transfer encoding", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", wantErr: "Transfer-Encoding", malformed: true},
		{name: "chunk size not hex", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", wantErr: "chunk size", malformed: true},
		{name: "chunk size negative", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n", wantErr: "chunk size", malformed: true},
		{name: "chunk size huge", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffff\r\n", wantErr: "over the limit", malformed: true},
		{name: "chunk cut", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", wantErr: "read chunk of 5 bytes", cutShort: true},
		{name: "chunk longer than its size", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n0\r\n\r\n", wantErr: "longer", malformed: true},
		{name: "no last chunk", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n", wantErr: "chunk size", cutShort: true},
		{name: "no end of trailer", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n", wantErr: "trailer", cutShort: true},
		{name: "endless header line", in: "HTTP/1.1 200 OK\r\nX: " + strings.Repeat("a", 20000) + "\r\n\r\n", wantErr: "longer than", malformed: true},
		{name: "too many headers", in: "HTTP/1.1 200 OK\r\n" + strings.Repeat("X: y\r\n", 101) + "\r\n", wantErr: "header lines", malformed: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := readResponse(bufio.NewReaderSize(strings.NewReader(tc.in), 4096))
			if tc.wantErr != "" {
				require.Error(t, err)
				require.Nil(t, r)
				require.Contains(t, err.Error(), tc.wantErr)
				require.Equal(t, tc.malformed, errors.Is(err, errMalformed), "errMalformed: %v", err)
				if tc.cutShort {
					require.ErrorIs(t, err, io.ErrUnexpectedEOF)
				}
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.status, r.status)
			require.Equal(t, tc.line, r.statusLine)
			require.Equal(t, tc.body, string(r.body))
			require.Equal(t, tc.keepAlive, r.keepAlive)
		})
	}
}

// TestReadResponseInSequence: two answers on one connection are read one
// after the other, each to its end and no further.
func TestReadResponseInSequence(t *testing.T) {
	br := bufio.NewReader(strings.NewReader("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}" +
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n[]\r\n0\r\n\r\n" +
		"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nnope"))
	for _, want := range []string{"{}", "[]", "nope"} {
		r, err := readResponse(br)
		require.NoError(t, err)
		require.Equal(t, want, string(r.body))
	}
	_, err := readResponse(br)
	require.ErrorIs(t, err, io.EOF)
	require.NotErrorIs(t, err, io.ErrUnexpectedEOF)
}

// FuzzReadResponse: no input panics the parser, and what it accepts
// has a valid status and a body within the limit.
func FuzzReadResponse(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x\r\nabc\r\n0\r\nT: 1\r\n\r\n",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
		"HTTP/1.0 404 Not Found\r\nConnection: close\r\n\r\nbody",
		"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		r, err := readResponse(bufio.NewReaderSize(strings.NewReader(string(in)), 64))
		if err != nil {
			require.Nil(t, r)
			return
		}
		require.GreaterOrEqual(t, r.status, 100)
		require.Less(t, r.status, 600)
		require.LessOrEqual(t, len(r.body), maxBody)
		require.LessOrEqual(t, len(r.body), len(in))
	})
}
