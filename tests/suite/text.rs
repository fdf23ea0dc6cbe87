//! The shipped Shakespeare, the character tokenizer, the held-out split and
//! the training windows.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use wgrad::io::text::Utf8Stream;
use wgrad::io::text::{gunzip_text, held_out_split, random_windows, shakespeare, CharTokenizer, Gpt2Bpe, Tokenizer};
use wgrad::Error;

#[test]
fn the_shipped_shakespeare_is_the_documented_text() {
    let text = shakespeare().expect("embedded text");
    // data/README.md: 5,057,323 bytes of ASCII, 84 distinct bytes.
    assert_eq!(text.len(), 5_057_323);
    assert!(text.is_ascii());
    let tokenizer = CharTokenizer::from_text(&text).expect("tokenizer");
    assert_eq!(tokenizer.vocab_size(), 84);
    // The served data/shakespeare.txt.gz (what the browser page fetches,
    // its build embedding none) decompresses to the same text.
    let served = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../data/shakespeare.txt.gz")).expect("the file");
    assert!(gunzip_text("test", &served).expect("gzip") == text);
}

#[test]
fn bytes_that_are_not_gzip_text_are_an_error_saying_so() {
    for (bytes, what) in [(&b"plain text"[..], "not gzip"), (&[0x1f, 0x8b, 8, 0][..], "truncated")] {
        match gunzip_text("test", bytes) {
            Err(Error::InvalidArgument { op: "test", reason }) => {
                assert!(reason.contains("not gzip-compressed UTF-8 text"), "{what}: {reason}")
            }
            other => panic!("{what}: expected an error, got {other:?}"),
        }
    }
}

#[test]
fn characters_round_trip_and_unknown_ones_are_errors_naming_them() {
    let tokenizer = CharTokenizer::from_text("ROMEO: hello\n").expect("tokenizer");
    let ids = tokenizer.encode("hello ROMEO").expect("known characters");
    assert_eq!(tokenizer.decode(&ids).expect("known ids"), "hello ROMEO");
    // Sorted vocabulary: ' ' < ':' < 'E' < 'M' ...
    assert_eq!(tokenizer.vocabulary(), "\n :EMORehlo");
    let again = CharTokenizer::from_vocabulary(&tokenizer.vocabulary()).expect("stored vocabulary");
    assert_eq!(again, tokenizer);
    match tokenizer.encode("hi!") {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("'i'") && reason.contains("position 1"), "{reason}")
        }
        other => panic!("expected an error, got {other:?}"),
    }
    assert!(tokenizer.decode(&[99]).is_err());
    assert!(CharTokenizer::from_vocabulary("aa").is_err());
    assert!(CharTokenizer::from_text("").is_err());
}

#[test]
fn validation_is_the_end_of_the_text_and_windows_shift_by_one() {
    let tokens: Vec<u32> = (0..1000).collect();
    let (train, val) = held_out_split(&tokens, 0.1).expect("split");
    assert_eq!((train.len(), val.len()), (900, 100));
    assert_eq!(val[0], 900, "the held-out part is the end, whole");
    assert!(held_out_split(&tokens, 1.0).is_err());
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (x, y) = random_windows(train, 4, 16, &mut rng).expect("windows");
    assert_eq!((x.len(), y.len()), (64, 64));
    for (row_x, row_y) in x.chunks(16).zip(y.chunks(16)) {
        for t in 0..16 {
            assert_eq!(row_y[t], row_x[t] + 1, "targets are the next token");
        }
        assert!(row_y[15] < 900, "a training window never reaches validation text");
    }
    assert!(random_windows(&tokens[..10], 1, 10, &mut rng).is_err());
}

#[test]
fn gpt2_bpe_gives_gpt2s_ids_and_round_trips() {
    let bpe = Gpt2Bpe::new().expect("r50k_base ships in the crate");
    // GPT-2's tokenizer (transformers' GPT2TokenizerFast) on this text.
    assert_eq!(bpe.encode("Hello world"), vec![15496, 995]);
    let tokenizer = Tokenizer::Gpt2(bpe);
    assert_eq!(tokenizer.vocab_size(), 50257);
    let text = "ROMEO: But, soft! what light through yonder window breaks? — café";
    let ids = tokenizer.encode(text).expect("any text encodes");
    assert_eq!(tokenizer.decode(&ids).expect("ids decode"), text);
    match tokenizer.decode(&[50257]) {
        Err(Error::InvalidArgument { reason, .. }) => assert!(reason.contains("50257"), "{reason}"),
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn a_character_split_across_tokens_streams_once_whole() {
    let mut stream = Utf8Stream::default();
    let bytes = "é!".as_bytes();
    assert_eq!(stream.push(&bytes[..1]), "");
    assert_eq!(stream.push(&bytes[1..]), "é!");
    assert_eq!(stream.push(&[0xff, b'a']), "\u{FFFD}a");
    assert_eq!(stream.push(&[0xc3]), "");
    assert_eq!(stream.finish(), "\u{FFFD}");
}
