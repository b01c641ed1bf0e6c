// A real OpenID Connect provider for the dashboard's browser check (scripts/dashboard_check.py):
// `oidc-provider` (npm) with its development sign-in pages, where any login name and password
// are accepted and the login name is the account: `sub` and a verified `email`.
//
// Usage: node provider.mjs PORT REDIRECT_URI CLIENT_SECRET
// Serves the issuer http://localhost:PORT with one confidential client, `hearth`, allowed to
// redirect to REDIRECT_URI (the authorization-code flow, PKCE required); prints "ready" once
// listening.
import Provider from 'oidc-provider';

const [port, redirectUri, secret] = process.argv.slice(2);
if (!port || !redirectUri || !secret) {
  console.error('usage: node provider.mjs PORT REDIRECT_URI CLIENT_SECRET');
  process.exit(2);
}

const provider = new Provider(`http://localhost:${port}`, {
  clients: [{
    client_id: 'hearth',
    client_secret: secret,
    redirect_uris: [redirectUri],
    grant_types: ['authorization_code'],
    response_types: ['code'],
    token_endpoint_auth_method: 'client_secret_basic',
  }],
  claims: { openid: ['sub'], email: ['email', 'email_verified'], profile: ['name'] },
  // The ID token carries the e-mail claims (Hearth reads who signed in from it alone).
  conformIdTokenClaims: false,
  pkce: { required: () => true },
  async findAccount(ctx, id) {
    return {
      accountId: id,
      async claims() {
        return { sub: id, email: id, email_verified: true, name: id };
      },
    };
  },
});

provider.listen(Number(port), () => console.log('ready'));
